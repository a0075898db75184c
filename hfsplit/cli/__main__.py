import sys

from hfsplit.cli.plan import main

sys.exit(main())
