import sys

from paraxis.cli.main import main

sys.exit(main())
