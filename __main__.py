import sys

from gemrec.cli import main

sys.exit(main())
