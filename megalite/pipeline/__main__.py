"""python -m megalite.pipeline --pp 4 --micro-batches 8 [--vpp 2]: print a schedule's timeline."""
from megalite.pipeline.simulator import main

main()
