"""`python -m streamfence`: the `streamfence` command."""

from streamfence.cli import main

main()
