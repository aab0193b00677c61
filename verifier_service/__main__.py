import sys

from verifier_service.server import main

sys.exit(main())
