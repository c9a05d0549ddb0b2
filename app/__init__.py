"""ranktrace's user-facing side: the `ranktrace` command line (and later the Dash dashboard)."""
