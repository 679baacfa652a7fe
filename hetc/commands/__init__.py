"""One module per `hetc` verb; see `hetc.cli.VERBS`."""
