"""The ``kernel-cache`` command line: option parsing and the commands."""
