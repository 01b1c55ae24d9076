import os

os.environ["SGLANG_SM120_TWOSHOT_LAMPORT_MAX_BYTES"] = "16"
