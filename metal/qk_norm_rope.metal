#include "dialect.h"
#include "qk_norm_rope.h"
