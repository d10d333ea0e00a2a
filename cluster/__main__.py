import sys

from pdcluster.cluster.cli import main

sys.exit(main())
