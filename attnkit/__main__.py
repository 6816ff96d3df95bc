from .cli.main import main

raise SystemExit(main(prog="python -m attnkit"))
