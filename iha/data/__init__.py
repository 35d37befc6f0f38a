"""SFT data: row schemas to chat messages, loading and length filtering (`messages`), GSM8K rows (`gsm8k`), and the
offline demo's generated word problems (`word_problems`)."""
