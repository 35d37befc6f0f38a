"""What every wing of the tools shares: atomic files and folders (nothing half-written), optional packages named
with their pip command, attributes imported on first use."""
