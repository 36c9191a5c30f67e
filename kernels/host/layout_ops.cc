// placeholder, replaced by the host ops implementation
