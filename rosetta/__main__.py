import sys

from rosetta.main import main

sys.exit(main())
