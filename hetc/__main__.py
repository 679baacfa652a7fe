from hetc.cli import program

program()
