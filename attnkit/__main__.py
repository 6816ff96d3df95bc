from .cli.main import command_name, main

raise SystemExit(main(prog=command_name()))
