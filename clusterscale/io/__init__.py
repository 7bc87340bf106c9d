"""Reading and writing: the run directory and its layout, input files, the bundled dataset, and the mined negatives'
files (negatives: their fingerprint, candidates, draw and sidecar layout)."""
