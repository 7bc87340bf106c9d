"""Reading and writing: the run directory and its layout, input files, the bundled dataset, and the mined negatives'
files (negatives: their fingerprint, candidates, draw and sidecar layout), and the sizing rules the stages follow and
plan predicts with (sizing)."""
