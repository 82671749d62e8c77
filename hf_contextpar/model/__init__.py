"""What the library reads from, and patches into, the user's model: the input contract (`contract`),
the cost model's shape of the loaded model (`shape`), and position-dependent RoPE (`rope`)."""
