"""Research code that measures IHA, kept beside the package and out of its wheel: a user who installs the model
integration does not get it. Each task runs from a checkout of the repository (its root on the path) as a module:

    python -m research.synthetic           the paper's relation-composition task: MHA, 2-simplicial and IHA
    python -m research.polynomial_filter   the paper's polynomial filter, trained: MHA with k heads against IHA
    python -m research.ab                  the A/B of SFT on a model as it is against SFT on its IHA conversion

`statistics` holds the paired tests all three report with. Research imports the installed `iha` package (its model,
conversion, training and evaluation, and the command line's flag style, `iha.cli.arguments`); `iha` never imports
research (tests/test_wing_imports.py)."""
