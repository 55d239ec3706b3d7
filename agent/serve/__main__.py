import sys

from silentswarm.agent.serve.main import main

sys.exit(main())
