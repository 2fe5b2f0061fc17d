"""EXL3 conversion: the calibrated streaming pipeline, its ranks, families and the DFlash2 drafter."""
