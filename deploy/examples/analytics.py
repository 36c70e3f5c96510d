"""Example analytics over a stream's sealed segments: events per epoch, and an
aggregation over a JSON field of the payloads.

    spark-submit deploy/examples/analytics.py --master-address 127.0.0.1:7070 \
        --stream demo/orders --field kind

(or `python deploy/examples/analytics.py ...` with the `spark` extra installed). Events
whose payload is not a JSON object count under `(not json)`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
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


def analyse(
    spark: Any, master_address: str, stream: str, field: str, certs_dir: str = "", token: str = ""
) -> Report:
    from pyspark.sql import functions as F

    from streamengine.client.spark import register

    register(spark)
    events = (
        spark.read.format("streamengine")
        .option("master", master_address)
        .option("stream", stream)
        .option("certsDir", certs_dir)
        .option("token", token)
        .load()
    )
    events = events.cache()
    total = events.count()
    per_epoch = [
        (row["epoch"], row["count"])
        for row in events.groupBy("epoch").count().orderBy("epoch").collect()
    ]
    value = F.get_json_object(F.col("payload").cast("string"), f"$.{field}")
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
    parser.add_argument("--token", default=os.environ.get("STREAMENGINE_TOKEN", ""))
    args = parser.parse_args()
    spark = session()
    try:
        report = analyse(
            spark, args.master_address, args.stream, args.field, args.certs_dir, args.token
        )
    finally:
        spark.stop()
    print(json.dumps(report.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
