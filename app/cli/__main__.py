"""`python -m app.cli`, as `rackplane`."""

from app.cli import main

if __name__ == "__main__":
    main()
