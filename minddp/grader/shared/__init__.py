"""What several exercises' checks share, each part in a file named for what it does.

    minddp grade exercises/naive.py      # checks/naive.py runs data_parallel.py's checks

    training.py        the models, the batches, one training run recorded; a result's form
    data_parallel.py   a DDP class beside stock DDP: the run, its verdict, the checks naive
                       and bucketed share
    pipeline_lists.py  stock's interleaved schedules' lists, made on real stages, read and
                       spelled: what interleaved and zero_bubble share
"""
