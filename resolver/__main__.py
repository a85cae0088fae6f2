"""``python -m resolver``: one resolver pass, the same as ``outbox resolve``."""

from outbox.cli import main

if __name__ == "__main__":
    main(["resolve", *__import__("sys").argv[1:]], prog_name="python -m resolver")
