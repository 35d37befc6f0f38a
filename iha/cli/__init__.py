"""The command line: `main` (the `iha` command and the console scripts) and one module per subcommand, each with
`make_parser(prog)` and `main(argv, prog)`; `arguments` (the one flag style) and `running` (the one way a command
ends: its exit status, errors as one line)."""
