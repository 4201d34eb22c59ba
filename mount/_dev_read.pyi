# mount/_dev_read.c: the contract is mount/receiver.py's _read_calls.

def read_request(fd: int, buffer: bytearray, spin_ns: int, /) -> int: ...
def answer_miss(
    fd: int,
    buffer: bytearray,
    size: int,
    dirs: dict[int, dict[bytes, object]],
    noted: list[tuple[int, bytes]],
    entry: bytes,
    /,
) -> int: ...
