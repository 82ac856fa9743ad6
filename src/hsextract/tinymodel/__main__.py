"""`python -m hsextract.tinymodel`: build the tiny model."""

from hsextract.tinymodel.build import main

main()
