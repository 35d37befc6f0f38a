"""The model wing: one folder per model, each the folder of files that travels with the weights."""
