"""Communication between the ranks: the process group (`group`), the collectives the attention
algorithms and checks use, with byte and wait accounting (`collectives`), the shared-memory
all-gather between local processes (`shm`), and every rank-agreement check (`agreement`)."""
