"""`python -m bench.serve ...` runs `xpod bench serve ...`."""

import sys

from runtime import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", "serve", *sys.argv[1:]]))
