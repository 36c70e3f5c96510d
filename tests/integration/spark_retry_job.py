"""A Spark batch write whose tasks fail their first attempt past their first appended
batch: `python -m tests.integration.spark_retry_job MASTER STREAM [PRODUCER_ID]`.

Its own Spark (`local[2,2]`: one retry per task), so that no other Spark test runs with
retries that could hide a failure. Rows `row-N`, N from 0 to `ROWS` - 1, in two
partitions; a UDF fails the first attempt of each task at its partition's row
`FAIL_AT`, after the task appended its first `WRITE_BATCH_ROWS` rows.
"""

from __future__ import annotations

import os
import sys

ROWS = 50_000
PARTITION_ROWS = ROWS // 2
FAIL_AT = 24_000  # of a partition's rows: far past what the stages between read ahead


def main() -> int:
    master, stream = sys.argv[1:3]
    producer_id = sys.argv[3] if len(sys.argv) > 3 else ""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark import TaskContext
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from streamengine.client.spark import register

    spark = (
        SparkSession.builder.master("local[2,2]")
        .appName("streamengine-retry")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        # The sink takes its rows in Arrow batches of this many: small, so that a task
        # appends its first batches before the UDF reaches the row it fails at.
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)

    def fail_first_attempt(number: int) -> str:
        context = TaskContext.get()
        first_attempt = context is not None and context.attemptNumber() == 0
        if first_attempt and number % PARTITION_ROWS == FAIL_AT:
            raise RuntimeError("the first attempt fails past its first appended batch")
        return f"row-{number}"

    payload = F.udf(fail_first_attempt, "string")
    frame = spark.range(0, ROWS, numPartitions=2).select(payload("id").alias("payload"))
    writer = frame.write.format("streamengine").option("master", master)
    if producer_id:
        writer = writer.option("producerId", producer_id)
    writer.option("stream", stream).mode("append").save()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
