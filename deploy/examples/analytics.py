"""Example analytics over a stream's sealed segments: events per epoch, and an
aggregation over a JSON field of the payloads.

    spark-submit deploy/examples/analytics.py --master-address 127.0.0.1:7070 \
        --stream demo/orders --field kind

(or `python deploy/examples/analytics.py ...` with the `spark` extra installed). Events
whose payload is not a JSON object count under `(not json)`.

Secured clusters: `--certs-dir` (with `ca.crt`), and the driver's token from
`--token-file` or $STREAMENGINE_TOKEN (none: the certs dir's `client.root`, a cluster
admin). Executors never get the driver's credentials: a cluster-admin driver mints them
a read token limited to the stream for `--executor-token-ttl-s`; `--executor-token-file`
gives one instead (`streamengine token create --role read --stream NAME`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Report:
    events: int
    per_epoch: list[tuple[int, int]]
    per_field_value: list[tuple[str, int, float]]  # value, events, mean payload bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "per_epoch": [{"epoch": e, "events": n} for e, n in self.per_epoch],
            "per_field_value": [
                {"value": v, "events": n, "mean_payload_bytes": round(m, 1)}
                for v, n, m in self.per_field_value
            ],
        }


def session() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from streamengine.client.spark_jvm import start_jvm

    start_jvm()  # the driver may already talk gRPC: no fork of it (spark_jvm)
    spark = (
        SparkSession.builder.appName("streamengine-analytics")
        .master(os.environ.get("SPARK_MASTER", "local[2]"))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@dataclass(frozen=True)
class Access:
    """How the job reaches a secured cluster (all empty: plaintext)."""

    certs_dir: str = ""
    token: str = field(default="", repr=False)  # the driver's
    executor_token: str = field(default="", repr=False)
    executor_token_ttl_ms: int = 0  # 0: the data source's default


def analyse(
    spark: Any, master_address: str, stream: str, field_name: str, access: Access = Access()
) -> Report:
    from pyspark.sql import functions as F

    from streamengine.client.spark import register

    register(spark)
    reader = (
        spark.read.format("streamengine")
        .option("master", master_address)
        .option("stream", stream)
        .option("certsDir", access.certs_dir)
        .option("token", access.token)
        .option("executorToken", access.executor_token)
    )
    if access.executor_token_ttl_ms:
        reader = reader.option("executorTokenTtlMs", str(access.executor_token_ttl_ms))
    events = reader.load()
    events = events.cache()
    total = events.count()
    per_epoch = [
        (row["epoch"], row["count"])
        for row in events.groupBy("epoch").count().orderBy("epoch").collect()
    ]
    value = F.get_json_object(F.col("payload").cast("string"), f"$.{field_name}")
    per_value = (
        events.withColumn("value", F.coalesce(value, F.lit("(not json)")))
        .groupBy("value")
        .agg(F.count("*").alias("events"), F.avg(F.length("payload")).alias("mean_bytes"))
        .orderBy(F.desc("events"), "value")
        .collect()
    )
    events.unpersist()
    return Report(
        total,
        per_epoch,
        [(row["value"], row["events"], float(row["mean_bytes"])) for row in per_value],
    )


def _secret(path: Path) -> str:
    return path.read_text().strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_master = os.environ.get("STREAMENGINE_MASTER", "127.0.0.1:7070")
    parser.add_argument("--master-address", default=default_master)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--field", default="kind", help="JSON field to aggregate by")
    parser.add_argument(
        "--certs-dir",
        default=os.environ.get("STREAMENGINE_CERTS_DIR", ""),
        help="TLS: the certs dir with ca.crt (default: $STREAMENGINE_CERTS_DIR)",
    )
    parser.add_argument(
        "--token-file", type=Path, help="the driver's token (default: $STREAMENGINE_TOKEN)"
    )
    parser.add_argument("--executor-token-file", type=Path, help="the executors' read token")
    parser.add_argument(
        "--executor-token-ttl-s",
        type=int,
        default=0,
        help="lifetime of the read token a cluster-admin driver mints (default 1 h)",
    )
    args = parser.parse_args()
    access = Access(
        args.certs_dir,
        _secret(args.token_file) if args.token_file else os.environ.get("STREAMENGINE_TOKEN", ""),
        _secret(args.executor_token_file) if args.executor_token_file else "",
        args.executor_token_ttl_s * 1000,
    )
    spark = session()
    try:
        report = analyse(spark, args.master_address, args.stream, args.field, access)
    finally:
        spark.stop()
    print(json.dumps(report.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
