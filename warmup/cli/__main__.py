from warmup.cli.main import main

raise SystemExit(main())
