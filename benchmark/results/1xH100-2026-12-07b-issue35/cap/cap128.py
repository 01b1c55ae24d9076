import sgl_kernel_sm120.config as c

c.MAX_ROW_SPLIT_BLOCKS = 128
