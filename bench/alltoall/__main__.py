"""`python -m bench.alltoall ...` runs `xpod bench alltoall ...`."""

import sys

from runtime import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", "alltoall", *sys.argv[1:]]))
