"""`python -m serving.deploy`: the `deploy` command."""

import sys

from serving.deploy.cli import main

if __name__ == "__main__":
    sys.exit(main())
