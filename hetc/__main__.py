from hetc.ir.interrupt import watch

watch()     # first: a Ctrl-C from here on is remembered (Note [a Ctrl-C an import swallows])
try:
    from hetc.cli import program
except KeyboardInterrupt:   # Ctrl-C while Python loads hetc, before `program` can catch it
    raise SystemExit(130) from None

program()
