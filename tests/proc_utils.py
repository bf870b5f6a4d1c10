"""Process checks shared by the server tests that start processes (CLI, engine process)."""


def gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, not yet reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
