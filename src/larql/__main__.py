"""`python -m larql …` = the `larql` command."""

from larql.cli.app import main

main()
