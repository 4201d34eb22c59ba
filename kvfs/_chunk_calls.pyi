import mmap

def load(path: str, buffer: memoryview | mmap.mmap, flags: int, /) -> tuple[int, int]: ...
def store(
    tmp: str,
    path: str,
    data: memoryview | bytes | mmap.mmap,
    flags: int,
    mode: int,
    declare: bool = False,
    /,
) -> int | None: ...
