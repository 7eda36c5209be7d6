"""``python -m jls.demo``."""

from jls.demo import main

main()
