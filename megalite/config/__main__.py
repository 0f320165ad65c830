"""`python -m megalite.config docs`: docs/configuration.md, generated from the sections."""
import sys

from megalite.config.docs import reference_markdown

if __name__ == "__main__":
    if sys.argv[1:] != ["docs"]:
        sys.exit("usage: python -m megalite.config docs > docs/configuration.md")
    sys.stdout.write(reference_markdown())
