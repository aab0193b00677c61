import sys

from specfleet.bench import main

sys.exit(main())
