import sys

from pagedserve.cli import main

if __name__ == "__main__":  # not when a spawned child (--api-server-count) imports this module
    sys.exit(main())
