"""Child process for the crash tests: save a large checkpoint to one path, forever.

    python save_loop.py PATH MEGABYTES [BACKEND]

Generation g writes {"gen": g, "data": <MEGABYTES MiB of float32 all equal to g>, "tail": [g]*3}
so a reader can check that the file it finds is one whole generation. After each durable
save the generation number is printed on stdout (flushed), so the parent knows the file
exists. The parent SIGKILLs this process at a random instant.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import fp_core  # noqa: E402


def main() -> None:
    path, mib = sys.argv[1], int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
    data = torch.empty(mib * (1 << 20) // 4, dtype=torch.float32)
    gen = 0
    while True:
        gen += 1
        data.fill_(float(gen))
        fp_core.save({"gen": gen, "data": data, "tail": [gen] * 3}, path, backend=backend)
        sys.stdout.write(f"{gen}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
