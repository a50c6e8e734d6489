from onnxgen.cli import main

raise SystemExit(main())
