"""Model cards, licences and `iha push`: what a folder carries to the Hugging Face Hub."""
