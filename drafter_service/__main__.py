import sys

from drafter_service.server import main

sys.exit(main())
