"""Reading and writing: the run directory and its layout, input files, the bundled dataset."""
