"""`python -m pdcluster ...` is the `pdcluster` command."""

from pdcluster.cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
