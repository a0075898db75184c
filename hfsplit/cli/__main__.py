import sys

from hfsplit.cli.commands import main

sys.exit(main())
