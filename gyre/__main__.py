"""`python -m gyre …`: the `gyre` command."""

from gyre.cli import main

if __name__ == "__main__":
    main()
