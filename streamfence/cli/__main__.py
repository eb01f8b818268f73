"""`python -m streamfence.cli`: the `streamfence` command."""

from streamfence.cli import main

main()
